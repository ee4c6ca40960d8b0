#!/bin/sh
# cryobox stage 2, under tini as PID 1: run the guest agent and restart it if it dies.
# The compiled front (cryobox-agent, guest/front.c) owns the port and starts the Python
# agent behind it for what it does not serve itself; its Python part alone where an
# image has no front.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PYTHONPATH=/run/cryobox/lib PYTHONDONTWRITEBYTECODE=1 HOME=/root LANG=C.UTF-8
cd /
while :; do
    if [ -x /run/cryobox/cryobox-agent ]; then
        /run/cryobox/cryobox-agent /usr/bin/python3 -m cryobox.guest.agent --fd 3
    else
        /usr/bin/python3 -m cryobox.guest.agent
    fi
    echo "cryobox: guest agent exited with status $?, restarting"
    sleep 1
done
