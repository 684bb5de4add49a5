"""The governed backward: what runs in place of ``torch.autograd.backward``
(the entry, the call, the decision, the routes, running plans and bindings, the
Python planner, checkpoint hints) and ``install``, which switches it on."""
