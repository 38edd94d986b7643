"""`featcal-llm bench`: synthetic 8B-shaped checkpoints, per-phase timing, FLOP/byte counts, roofline ratios.

Modules: `synthetic` builds the checkpoints, `costs` counts FLOPs and bytes
analytically, `machine` measures the machine's own matmul and disk rates and
memory peaks, `driver` runs the engine's layer loop with a per-layer timer, and
`report` turns the measurements into the table and the JSON.
"""
