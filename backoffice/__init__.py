"""Support's and finance's side, above purchases: every app's admin (`admin/`), the staff
roles (`roles`), the timeline's words (`timeline`), the books and their export (`books`,
`books_export`), the Prometheus metrics (`metrics`) and the staff commands. A Django app with
no models: its changes go through the purchases services, which write the timeline."""
