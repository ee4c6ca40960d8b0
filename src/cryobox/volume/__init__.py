"""Named volumes: folders on the host that outlive sandboxes, mounted in guests by a
FUSE file system whose every operation the host serves by path (:mod:`.serve`)."""
