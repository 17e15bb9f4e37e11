"""The drafters' own networks (nn.Modules) and what they share: checkpoint I/O and a paged KV cache.

One file per network (``dflash_model``, ``dspark_model``, ``eagle3_model``, ``mtp_model``, ...); shared pieces:
``checkpoint`` (safetensors + config.json with errors naming the tensor / field), ``draft_kv`` (a drafter's
paged KV cache) and ``feature_chain`` (the EAGLE-3 / MTP drafting loop). Networks never own an embedding or LM
head of the target's size unless a checkpoint ships one; drafters pass the target's (frozen) modules in.
"""
