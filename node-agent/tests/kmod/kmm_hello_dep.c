// SPDX-License-Identifier: GPL-2.0
/*
 * kmm_hello_dep: depends on kmm_hello through kmm_hello_greet(), so modprobe must
 * load kmm_hello first.
 */
#include <linux/init.h>
#include <linux/module.h>

int kmm_hello_greet(const char *who);

static int __init kmm_hello_dep_init(void)
{
	return kmm_hello_greet("kmm_hello_dep");
}

static void __exit kmm_hello_dep_exit(void)
{
}

module_init(kmm_hello_dep_init);
module_exit(kmm_hello_dep_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("kmm-fleet sample module depending on kmm_hello");
MODULE_VERSION("1.0");
