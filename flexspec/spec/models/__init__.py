"""The drafters' own networks (nn.Modules) and what they share: checkpoint I/O and a paged KV cache.

One file per network: ``dflash_model`` (DFlash, DSpark's backbone), ``dspark_model``, ``eagle3_model``,
``mtp_model``. They never own an embedding or LM head of the target size unless a checkpoint ships one;
drafters pass the target's (frozen) modules in.
"""
