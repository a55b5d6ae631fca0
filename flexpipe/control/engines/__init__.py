"""The engines the controller runs: from a planned instance to a launch spec, adopting
engines a previous controller left running, taking over from another controller, Ray."""
