"""A plain E2B program: it imports only ``e2b``. Pointed at a cryobox server by three
variables, it runs unchanged on real VMs of your own machine:

    export E2B_API_URL=http://127.0.0.1:8080/e2b
    export E2B_SANDBOX_URL=http://127.0.0.1:8080/e2b
    export E2B_API_KEY=$(.venv/bin/cryobox tenant create demo | tail -1)
    .venv/bin/python examples/e2b_unchanged.py
"""

import time

from e2b import Sandbox

with Sandbox.create(envs={"GREETING": "hello"}, metadata={"example": "e2b"}) as sbx:
    sbx.files.write(
        "app/main.py", "import os\nprint(os.environ['GREETING'], 'from', os.uname().nodename)\n"
    )
    result = sbx.commands.run(
        "python3 app/main.py", on_stdout=lambda line: print("live:", line, end="")
    )
    print("exit code", result.exit_code)

    counter = sbx.commands.run(
        # written to a new name and renamed, so a read never sees a half-written count
        "i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; "
        "mv /tmp/count.new /tmp/count; sleep 0.2; done",
        background=True,
        timeout=0,
    )
    time.sleep(1)  # let it count a little
    sbx.pause()  # the whole machine is saved; no CPU, no RAM
    back = Sandbox.connect(sbx.sandbox_id)  # resumed: the loop goes on counting
    print("still counting:", back.files.read("/tmp/count").strip())
    print("files:", [entry.name for entry in back.files.list("app")])
