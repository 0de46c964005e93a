"""twistd plugin: ``twistd -n synflow --config shared.yaml --config <instance>.yaml``.

No ``__init__.py`` lives in ``twisted/`` or ``twisted/plugins/``: Twisted's
plugin discovery uses namespace packages, and shipping one would overwrite
Twisted's own on install.
"""

from twisted.application.service import ServiceMaker

synflow = ServiceMaker(
    "synflow",
    "synflow.app.plugin",
    "Run one synflow process (master, event_persister, federation_sender or cache_invalidator) "
    "from YAML config files.",
    "synflow",
)
