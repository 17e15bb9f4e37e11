"""TP-aware building blocks. Every parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)``."""
