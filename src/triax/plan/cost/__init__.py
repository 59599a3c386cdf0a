"""What a plan costs: profiles (measured here, or analytic from data sheets), the
roofline, collectives, the memory model and the simulator (`simulate_plan`)."""
