"""Recipe, calibration data, checkpoints, mergekit and the model card: everything that reads or writes files."""
