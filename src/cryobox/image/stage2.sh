#!/bin/sh
# cryobox stage 2, under tini as PID 1: run the guest agent and restart it if it dies.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PYTHONPATH=/run/cryobox/lib PYTHONDONTWRITEBYTECODE=1 HOME=/root LANG=C.UTF-8
cd /
while :; do
    /usr/bin/python3 -m cryobox.guest.agent
    echo "cryobox: guest agent exited with status $?, restarting"
    sleep 1
done
