from flexspec.distributed.tp_group import TPGroup, shard_range

__all__ = ["TPGroup", "shard_range"]
