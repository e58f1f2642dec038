"""What the engines (offload/, zero/) and the front-ends use of torch's runtime, below them
all: hooks that fire when a parameter's gradient is ready (:mod:`.grad_hooks`) and small
process-group helpers (:mod:`.distributed`).  Imports nothing of the package."""
