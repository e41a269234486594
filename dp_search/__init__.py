"""meshplan.dp_search"""
