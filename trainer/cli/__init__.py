"""The trainer's commands of the `replay` CLI (train, plan, demo), registered by trainer/plugin.py."""
