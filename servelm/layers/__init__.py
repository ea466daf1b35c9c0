"""Building blocks shared by the model families: linear methods (more to move here)."""
