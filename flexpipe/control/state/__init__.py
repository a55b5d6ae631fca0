"""What the controller keeps in the store across restarts: its journal of running engines,
its lease on the deployment, other tenants' occupations and the models' recent rates."""
