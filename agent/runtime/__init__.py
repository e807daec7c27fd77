"""The device's serving side: the committed model served to the application, torch-free."""
