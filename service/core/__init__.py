"""The core of serving: requests admitted (engine.py), each step planned (scheduler.py, which owns the K/V rows: kv_rows.py)
and run (batch.py, over kvserve.runtime), and each sequence's tokens taken (sequence.py and its sampling, text,
structure and drafts). It knows no transport and no process: nothing here imports edges/ or process/."""
