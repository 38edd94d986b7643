"""Calibration texts written by the experts themselves (`featcal.data.<expert>: {generate: ...}`).

FeatCal needs inputs on which each expert behaves as itself; an expert's own
samples are such inputs, so users who never saw the experts' training data can
still calibrate. `run.generated_sequences` is the entry point the pipeline calls.
"""
