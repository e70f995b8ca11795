import os

# Tests share the 2 cores with nothing else; keep torch from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
