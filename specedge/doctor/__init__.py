"""`specedge doctor`: what this device is and what will run on it (machine.py, software.py),
and a bundle on it (bundle_check.py), as one screen or JSON (report.py)."""
