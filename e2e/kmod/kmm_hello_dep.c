// SPDX-License-Identifier: GPL-2.0
/*
 * kmm_hello_dep: depends on kmm_hello through kmm_hello_greet(), so modprobe must
 * load kmm_hello first. Its parameter `who` lets tests see, in
 * /sys/module/kmm_hello_dep/parameters/who and in the greeting, the parameters a
 * module was loaded with.
 */
#include <linux/init.h>
#include <linux/module.h>
#include <linux/moduleparam.h>

int kmm_hello_greet(const char *who);

static char *who = "kmm_hello_dep";
module_param(who, charp, 0444);
MODULE_PARM_DESC(who, "whom kmm_hello greets when this module loads");

static int __init kmm_hello_dep_init(void)
{
	return kmm_hello_greet(who);
}

static void __exit kmm_hello_dep_exit(void)
{
}

module_init(kmm_hello_dep_init);
module_exit(kmm_hello_dep_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("kmm-fleet sample module depending on kmm_hello");
MODULE_VERSION("1.0");
