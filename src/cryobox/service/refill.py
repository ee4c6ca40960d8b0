"""The warm pools' refill process: ``python -m cryobox.service.refill`` (see
:mod:`cryobox.service.pool_refill`). A module of its own so that ``-m`` does not run the
worker module a second time beside the copy its package imports."""

from cryobox.service.pool_refill import main

if __name__ == "__main__":
    main()
