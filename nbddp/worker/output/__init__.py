"""A rank's rich output in the launching cell: ``display()`` and figures as MIME bundles
(``rich``, ``bundles``) and the ranks' matplotlib backend (``figures``)."""
