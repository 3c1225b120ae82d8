"""The bottom layer: errors, files and locks, credentials, audit, processes, the on-disk formats every layer reads."""
