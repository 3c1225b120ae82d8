"""A run's identity: its experiment key from config, data and starting weights, and its claimed directory."""
