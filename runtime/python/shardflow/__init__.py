"""shardflow from Python: `import shardflow.torch as sft` (shardflow/torch.py)."""
