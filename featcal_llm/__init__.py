"""featcal-llm: FeatCal feature calibration as a mergekit post-merge stage."""

__version__ = "0.1.0"
