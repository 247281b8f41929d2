from django.apps import AppConfig


class BackofficeConfig(AppConfig):
    """Support's and finance's side: every app's admin, the staff roles, the books, the case
    file's pages and the metrics. No models and no migrations: it reads and acts on the
    purchases, payments and fulfillment records through their services."""

    name = "backoffice"

    def ready(self) -> None:
        from backoffice.roles import NEVER_SHOWN, ROLE_TABLE
        from core.admin import role_table_install

        # Who sees which admin field is the back office's table; the admin kernel applies it.
        role_table_install(ROLE_TABLE, NEVER_SHOWN)
