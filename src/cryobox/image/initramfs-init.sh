#!/bin/sh
# cryobox initramfs: load the virtio and ext4 modules, mount the root disk, hand over
# to cryobox-init (guest/init.c), which runs the guest agent. Busybox only; every failure powers the VM off
# with a line on the console saying why.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

fail() { echo "cryobox-init: $*"; poweroff -f; }

if grep -q 'cryobox.probe=1' /proc/cmdline; then
    echo "CRYOBOX-PROBE-OK"
    poweroff -f
fi

while read -r module; do
    # Not fatal: a CPU-specific variant (crc32c-intel) may not fit the emulated CPU.
    insmod "/lib/modules/$module" || echo "cryobox-init: cannot load $module"
done < /lib/modules/order

tries=0
while [ ! -b /dev/vda ]; do
    tries=$((tries + 1))
    [ "$tries" -gt 400 ] && fail "no root disk /dev/vda"
    sleep 0.05
done

mkdir -p /newroot
mount -t ext4 -o rw,noatime /dev/vda /newroot || fail "cannot mount /dev/vda"
mount -t tmpfs -o mode=755,size=64m tmpfs /newroot/run || fail "cannot mount /run"
mkdir -p /newroot/run/cryobox
cp -a /cryobox/lib /cryobox/so /cryobox/cryobox-init /cryobox/cryobox-agent /cryobox/cryobox-volume /newroot/run/cryobox/
mount --move /dev /newroot/dev
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
exec switch_root /newroot /run/cryobox/cryobox-init
