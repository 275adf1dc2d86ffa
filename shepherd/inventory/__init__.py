"""The inventory file: machines listed by hand, with their SSH user, host key and BMC.

* ``fields``: the error type and the small validators every part shares;
* ``host_keys``: OpenSSH public-key lines, their fingerprints, and reading a
  server's host key without logging in;
* ``bmc``: a machine's ``bmc`` table into a ``shepherd.power.BmcSpec``;
* ``file``: the whole file (``[defaults]`` merged under each entry) into
  ``ProviderMachine`` values; ``shepherd.providers.static`` serves them;
* ``probe``: ``shepherd inventory check --probe``, every BMC and SSH endpoint asked.

Why this package imports nothing itself: the provider needs only the parser, the
probe needs the power drivers; importing one must not drag in the other.
"""
