"""Per-step fault tolerance on torchft: data-parallel replica groups that heal from live peers."""
