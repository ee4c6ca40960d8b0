"""The cryobox command line."""
