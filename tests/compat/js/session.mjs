// An E2B user's session with E2B's own JavaScript SDK, unchanged: only E2B_API_URL,
// E2B_SANDBOX_URL and E2B_API_KEY point it at cryobox. Each line printed is checked by
// tests/compat/test_e2b_js.py.
import { Sandbox } from 'e2b'

const sbx = await Sandbox.create({ timeoutMs: 300_000, metadata: { from: 'js' } })
try {
  const ran = await sbx.commands.run('echo hello-$((6*7)); hostname')
  console.log(`run: ${ran.stdout.trim().split('\n').join(' ')}`)
  // A multipart upload streamed without a Content-Length, as this SDK sends it.
  await sbx.files.write('/home/user/js.txt', 'from the JS SDK\n')
  console.log(`read: ${(await sbx.files.read('/home/user/js.txt')).trim()}`)
  const entries = await sbx.files.list('/home/user')
  console.log(`listed: ${entries.some((entry) => entry.name === 'js.txt')}`)
  const background = await sbx.commands.run('sleep 600', { background: true })
  console.log(`killed: ${await background.kill()}`)
  const info = await sbx.getInfo()
  console.log(`info: ${info.sandboxId === sbx.sandboxId} ${info.metadata.from}`)
  // Killed while a command runs: its stream is dropped, as E2B's edge drops it, and
  // the SDK, finding the sandbox gone, says it was killed.
  const during = await sbx.commands.run('sleep 60', { background: true })
  await sbx.kill()
  const error = await during.wait().catch((e) => e)
  const said = String(error?.message).includes('sandbox was killed or reached its end of life')
  console.log(`killed during a run: ${error?.constructor?.name} ${said}`)
} finally {
  await sbx.kill()
}
console.log('js sdk: done')
