"""The embedded demo: a tiny Llama base, three fully fine-tuned experts, a Task Arithmetic
merge and its FeatCal calibration, all built from scratch on a CPU (``featcal-llm demo``)."""
