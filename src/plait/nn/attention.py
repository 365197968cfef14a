"""Attention masks shared by plait's models and layouts.

``document_causal_mask(doc_ids)`` is the mask of packed documents (``plait.data.packing``, where it lives so
the data loader can hand it to Hugging Face models): causal, and inside one document only. It takes the
batch's ``doc_ids`` and nothing else, so any layer or layout that holds a slice of them (a context-parallel
rank's queries and keys) can build its part of the mask.
"""

from plait.data.packing import document_causal_mask

__all__ = ["document_causal_mask"]
