"""Context parallelism: each sequence split over ``parallel.cp`` ranks along time.

A user training at 32K-128K tokens runs out of activation memory however many data or tensor-parallel ranks
they add: every rank holds its sequences' whole attention. Here the ``cp`` ranks of a group share the same
sequences and each holds ``1 / cp`` of every token-sized activation; attention, the one layer where a token needs
the others, brings the keys and values to each shard's queries.

What is plait's and what is PyTorch's:

* ``sharding``: the load-balanced causal split (rank ``i`` of ``N`` holds chunks ``i`` and ``2N-1-i`` of ``2N``,
  so every rank has as much causal work as the others), the labels shifted *before* the split (no target crosses
  a shard) and the global position ids (absolute and rotary positions stay right). PyTorch's
  ``context_parallel`` has the same round-robin balancer; plait's is a few index tensors and runs on any backend.
* ``ring``: key/value blocks travel round the ring (c10d batched point-to-point, issued before each block's
  compute and waited after it, so communication overlaps the block), the partial outputs merged by their
  log-sum-exp; backward passes keys, values and their gradient accumulators round the same ring (a custom
  ``autograd.Function``, flash-attention's backward per block). PyTorch's ``context_parallel``
  (``torch.distributed.tensor.experimental``) dispatches only the flash, memory-efficient and cuDNN SDPA
  kernels, none of which runs on the CPU, and takes over ``F.scaled_dot_product_attention`` globally; plait's
  ring runs wherever c10d does (gloo on CPU, NCCL on GPU), is exact in float32 and is what the tests prove.
* ``alltoall`` (DeepSpeed Ulysses): one all-to-all turns sequence shards into head shards, attention runs on
  ``H / cp`` heads over the whole sequence, a second all-to-all turns them back (its own adjoint in backward);
  heads must divide by cp (the error names ``ring``, which takes any head count).
* ``allgather``: keys and values all-gathered (Megatron's simplest form), the reference; backward gathers them
  again (only the shard's are kept) and reduces their gradients back to their owners.
* Packed documents (plait's GPT with ``document_mask``): every rank has the whole sequence's ``doc_ids`` (the
  context split slices them from the batch; no collective) and each implementation builds the document mask of each
  block or piece it computes from them, in forward and again in backward, never a (T, T) one; a query row that
  sees no key of a block weighs 0 in the log-sum-exp merge. Documents of any length, cut anywhere by the shards
  (torchtitan's packed-document cp needs multiples of 2 x cp). Grouped-query keys and values travel with their
  own heads under ``ring`` and ``allgather``.
* ``split``: context parallelism's step of the composition (``apply_context``: the attention routed) and its
  micro-step (``ContextSplit``): the engine gives it whole micro-batches and it shards them; gradients are averaged
  over dp x cp because the gradient-sync policy is given the ``dp_cp`` ranks (``plait.topology.FLATTENED``); the loss
  is one over the real tokens of the whole sequence (token counts of the whole sequence, never a mean of the shards'
  means).
* ``user_forward``: the user's own loop (``model(...)``, ``p.backward(loss)``) on whole micro-batches: the forward
  of the model ``setup`` returns cuts each call into this rank's shard as the context split does (labels shifted
  first, global positions, a padding mask as masking by ids), and without labels gathers the logits whole (its
  backward sums their gradients onto the owners).
"""
