"""The inventory file: machines listed by hand, with their SSH user, host key and BMC.

* ``fields``: the error, the kinds of value (pydantic types) every part shares, and
  how a finding of pydantic becomes one line naming the field;
* ``host_keys``: OpenSSH public-key lines, their fingerprints, and reading a
  server's host key without logging in;
* ``bmc``: a machine's ``bmc`` table, one pydantic model per driver, into a
  ``shepherd.bmc.BmcSpec``;
* ``file``: the whole file (``[defaults]`` merged under each entry, each entry a
  ``Machine`` model) into ``ProviderMachine`` values;
* ``provider``: ``StaticProvider``, the file served as a ``Provider``;
* ``probe``: ``shepherd inventory check --probe``, every BMC and SSH endpoint asked.

Why this package imports nothing itself: the provider needs only the parser, the
probe needs the power drivers, and the operators' reads only ``host_keys`` (without
pydantic: they must start fast); importing one must not drag in the others.
"""
