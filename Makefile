# The two commands: `make serve` (1P1D on the built-in tiny model at http://127.0.0.1:8000/v1)
# and `make test`. Both set up .venv/ first if needed (scripts/setup.sh is idempotent).
.PHONY: setup serve test test-fast

setup:
	@bash scripts/setup.sh

serve: setup
	.venv/bin/pdserve serve

test: setup
	@bash scripts/test.sh

# Control-plane and unit tests only (no vLLM engine is started).
test-fast: setup
	@bash scripts/test.sh -m "not e2e"
