"""The run's stages around the calibration (pipeline.py runs them in order): prepare.py before it, outputs.py after."""
