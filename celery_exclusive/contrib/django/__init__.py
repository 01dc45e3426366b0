"""Django integration: the ``django://<alias>`` lock store, a migration, ``manage.py exclusive``.

Add ``"celery_exclusive.contrib.django"`` to ``INSTALLED_APPS`` to get the migration that
creates the lock table (``manage.py migrate``) and the ``manage.py exclusive`` command. The
``django://`` store works without the app; with it installed the store creates nothing at
run time. Importing this package does not import Django.
"""
