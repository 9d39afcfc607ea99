"""Beyond one machine: find a stored prefix's owner node (``directory``) and move its bytes
through Mooncake's Transfer Engine (``transfer``, ``owner``, ``requester``).

Not wired into the store or SGLang yet: these pieces have their own tests and benchmark."""
