"""Purchase orchestration: the services that walk a purchase across the recovery boundaries."""
