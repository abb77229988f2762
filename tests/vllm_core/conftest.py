"""vLLM's own test files (upstream/, not committed) run only through run.py, in a
process with the shim on sys.path; the suite never collects them, nor the shim."""

collect_ignore = ["upstream", "shim", "run.py"]
