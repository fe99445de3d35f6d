"""Put ``tests/support/standin_path`` on PYTHONPATH and ``python -m sglang.launch_server`` runs
the SGLang stand-in (tests/support/sglang_standin.py): the trainer then starts it exactly as it
starts SGLang, from ``rollout.backend=sglang:...``."""
