"""Parallel layouts, composed by one function (``compose.parallelize``) behind one contract (``layout.Layout``): one
package per dimension (``tensor``, ``expert``, ``context``, ``pipeline``) and per gradient-sync policy (``data``,
``zero``, ``fsdp``; the base and registry in ``grad_sync``), the drivers beside them (``data.diloco``, ``replicas``).
Beside them, what every layout uses: how a rank runs its part of the model (``stages``), what a layout needs to know
about a model (``spec``), preparing a user's model (``prepare``), what a model class registers (``train_spec``;
plait's own and the lookup in ``model_specs``), repeated units (``units``), activation checkpointing
(``activation_checkpoint``) and offload (``offload``), compilation (``compile``), float8 (``float8``), activation
memory (``memory``) and meta-device models (``meta_init``). Checkpoint weights are ``plait.checkpoint``'s."""
