from django.apps import AppConfig


class DevtoolsConfig(AppConfig):
    name = "devtools"
    verbose_name = "Demo and test tooling"
