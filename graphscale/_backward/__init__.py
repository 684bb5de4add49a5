"""What a governed backward is made of: the call read once, the caller's
frame, the one gate, the decision (left alone, fast path, plan), the running
state and its two backends, checkpoint hints."""
