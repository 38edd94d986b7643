"""The method's arithmetic as pure tensor functions: statistics, the closed-form solves."""
