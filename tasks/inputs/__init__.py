"""What a run starts from: its starting weights, the live adapter, and both fetched onto each node."""
