"""The streaming layer loop: batches and host-resident streams, prefetch, recording, solving per layer, tuning, resume, drift."""
