"""Built-in backend plugins (installed as ``vcga.plugins``).

Each module is a plain pluggy plugin, loaded by module name through the same path as an
out-of-tree plugin, and imports only the public core API (``vcga.contract``, ``vcga.errors``,
``vcga.dtypes``, ``vcga.config``, ``vcga.cpu``) -- never another plugin.
"""
