"""The lifecycle's stages: the chain a retrain runs, the gate, approval, publishing, promotion and housekeeping."""
